"""The compact hybrid-parallel llama trainer built on the ckpt engine (see DESIGN.md §4)."""

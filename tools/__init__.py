"""Command-line front ends over the ckpt engine (thin: parse arguments, show progress, call ckpt)."""

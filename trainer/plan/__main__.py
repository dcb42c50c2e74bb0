"""``python -m trainer.plan``: the dry run's command line (:mod:`trainer.plan.cli`)."""

from trainer.plan.cli import main

raise SystemExit(main())

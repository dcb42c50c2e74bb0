from trainer.measure.cli import main

raise SystemExit(main())

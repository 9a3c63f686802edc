from diffcost.cli import main

raise SystemExit(main())

from paperclub.cli import main

raise SystemExit(main())

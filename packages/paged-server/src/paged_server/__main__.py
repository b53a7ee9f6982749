from paged_server.cli import main

raise SystemExit(main())

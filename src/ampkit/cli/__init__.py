"""The `ampkit` command line: one module per subcommand, registered in main.py."""

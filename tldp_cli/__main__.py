from tldp_cli.cli import main

main()

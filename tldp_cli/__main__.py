from tldp_cli.entry import main

main()

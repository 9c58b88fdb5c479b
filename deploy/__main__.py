from pdserve.deploy.cli import main

main()

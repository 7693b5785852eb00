from clusterfit.cli import main

main()

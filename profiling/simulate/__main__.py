from profiling.simulate.cli import main

main()

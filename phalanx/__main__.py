from phalanx.cli import main

main()

from quiverd.cli.process_exit import console

console()

from quiverd.cli.process_exit import console

if __name__ == "__main__":  # not when a worker process (anyio.to_process) loads it
    console()

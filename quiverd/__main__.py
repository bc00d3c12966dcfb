if __name__ == "__main__":  # not when a worker process (anyio.to_process) loads this file
    from quiverd.cli.process_exit import console

    console()

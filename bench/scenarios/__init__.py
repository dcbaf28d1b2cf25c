"""One module per benchmark scenario; each has ``run(bench: Bench) -> None``."""

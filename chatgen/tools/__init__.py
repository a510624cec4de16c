"""Tools a user runs on top of the library (each has a `chatgen` subcommand): check_sync.py
proves a weight sync exact against the trainer's own log-probs."""

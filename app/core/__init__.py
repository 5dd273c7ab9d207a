"""What every page stands on: the settings the operator gives in the environment (settings), the
models loaded once per process (models), the traces kept for every session (traces), and what one
browser session remembers (session)."""

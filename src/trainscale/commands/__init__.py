"""CLI sub-commands: one module each, each with register(app)."""

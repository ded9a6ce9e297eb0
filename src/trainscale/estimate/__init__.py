"""Pure arithmetic: no torch. Each formula lives in one function with its citation."""

"""The one exception the model loader raises for anything a user can fix."""


class ModelLoadError(Exception):
    """One-line, user-facing message; the CLI prints str(e) and exits 2."""

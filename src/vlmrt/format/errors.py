"""BundleError, apart from manifest.py so that the manifest's checks (manifest_checks.py) can raise it (stdlib only)."""


class BundleError(Exception):
    """A bundle that cannot be used: missing, altered, or of an unknown schema."""

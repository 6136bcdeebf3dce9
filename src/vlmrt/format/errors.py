"""BundleError, apart from manifest.py so that the manifest's checks (manifest_checks.py) can raise it (stdlib only)."""


class BundleError(Exception):
    """A bundle that cannot be used: missing, altered, or of an unknown schema."""


def malformed(what: str) -> BundleError:
    """A manifest that breaks one of its cross-field rules (checks.py, the kinds' own checks in manifest.py)."""
    return BundleError(f"manifest.json is malformed: {what}")

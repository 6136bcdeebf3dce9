"""The bundle format: the manifest (dataclasses, load / validate / save), its cross-field checks, the typed
JSON reader, the remembered sha256 verification, folders written whole or not at all, and BundleError."""

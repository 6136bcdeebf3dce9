"""Model families: one module each (Config.from_hf, load_weights, host_spec, default_max_context)."""

# preprocessor_config.json "resample" (PIL's enum values) -> the runtime's filter names
PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic"}


def resample_name(value) -> str:
    return PIL_RESAMPLE[value] if isinstance(value, int) else str(value).lower()

"""Media in: image and video sources read within limits (sources.py, url_policy.py), decoded, resized and tiled by
the manifest's named tiling op (image.py, image_native.py, naflex.py, pixels.py, aa_resize.py, video.py), and a tile
as the vision graph's inputs (tile_inputs.py, vision_inputs.py)."""

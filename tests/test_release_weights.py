"""pipeline.release_weights: a traced module's weights are freed (their storages emptied, whatever else holds
tensors on them: torch.export does after a trace), but the checkpoint's own storages (keep) and those the ONNX
exporter made non-resizable. Guards the export-memory discipline of docs/gemma4.md (on main 27f8984 the function is
missing: fails there)."""

from __future__ import annotations

import torch


def test_release_weights_frees_all_but_the_kept_and_numpy_shared():
    from vlmrt.export.pipeline import release_weights

    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    alias = m[0].weight.detach()  # (a tensor on the same storage, as torch.export leaves them)
    kept = m[1].weight.untyped_storage().data_ptr()
    viewed = m[2].weight.detach().numpy()  # (makes the storage non-resizable: freeing it would dangle the array)
    release_weights(m, {kept})
    assert alias.untyped_storage().nbytes() == 0 and m[0].bias.untyped_storage().nbytes() == 0
    assert m[1].weight.untyped_storage().nbytes() == 64 * 64 * 4
    assert m[2].weight.untyped_storage().nbytes() == 64 * 64 * 4 and viewed.sum() == viewed.sum()

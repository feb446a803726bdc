"""RoPE inverse frequencies, shared by the reference engine, the interpreter and the megakernel."""
from __future__ import annotations

import math

import torch

from tpmk.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[D/2] float32 inverse frequencies, with llama3 frequency-dependent scaling if configured."""
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # llama3: long wavelengths are slowed down by `factor`, short ones kept, and the band in
    # between interpolates linearly in 1/wavelength.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)

"""Image preprocessing as ``transformers.CLIPImageProcessor`` does it, with Pillow.

RGB, resize so the shortest side is ``size`` (bicubic; the long side
``int(size * long / short)``), centre crop ``crop x crop`` (top-left at
``(h - crop) // 2, (w - crop) // 2``), rescale by 1/255, normalise with the encoder's
mean and std -> ``[crop, crop, 3]`` float32, channels last as the encoders take it.
``pad=True`` is LLaVA-1.5's ``image_aspect_ratio="pad"``: expand to a square with the
mean colour (the image centred) before the resize.
"""

from __future__ import annotations

import dataclasses

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
    """CLIPImageProcessor's transform; ``processor(path)`` -> ``[crop, crop, 3]`` float32."""

    size: int  # shortest side after the resize
    crop: int  # square side after the centre crop
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    pad: bool = False  # expand to a square with the mean colour first (LLaVA-1.5 "pad")

    @classmethod
    def for_encoder(cls, kind: str, image_size: int, *, pad: bool = False) -> ImageProcessor:
        """The processor of an encoder: SigLIP normalises with 0.5, CLIP and ViT with
        OpenAI CLIP's mean and std."""
        mean, std = (SIGLIP_MEAN, SIGLIP_STD) if kind == "siglip" else (CLIP_MEAN, CLIP_STD)
        return cls(size=image_size, crop=image_size, mean=mean, std=std, pad=pad)

    def __call__(self, path: str) -> np.ndarray:
        """Decodes and transforms one file; raises ``OSError`` when it does not decode."""
        from PIL import Image

        with Image.open(path) as im:
            im.load()
            return self.transform(im)

    def check(self, path: str) -> None:
        """Reads only the file's header; raises ``OSError`` when it is no image Pillow
        knows (the pixels may still fail to decode)."""
        from PIL import Image

        with Image.open(path):
            pass

    def transform(self, im) -> np.ndarray:
        """The transform of an open ``PIL.Image``."""
        from PIL import Image

        im = im.convert("RGB")
        if self.pad:
            im = expand_to_square(im, tuple(int(255 * m) for m in self.mean))
        w, h = im.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.size, int(self.size * long / short)
        new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        if (new_w, new_h) != (w, h):
            im = im.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
        x = np.asarray(im)
        top, left = (new_h - self.crop) // 2, (new_w - self.crop) // 2
        if top < 0 or left < 0:  # CLIP pads a too-small image with zeros, centred
            x = _pad_to(x, self.crop)
            top, left = max(top, 0), max(left, 0)
        x = x[top : top + self.crop, left : left + self.crop]
        x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)
        return ((x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)).astype(
            np.float32
        )


def expand_to_square(im, color: tuple[int, ...]):
    """LLaVA's ``expand2square``: the image centred on a square of ``color``."""
    from PIL import Image

    w, h = im.size
    if w == h:
        return im
    side = max(w, h)
    out = Image.new(im.mode, (side, side), color)
    out.paste(im, ((side - w) // 2, (side - h) // 2))
    return out


def _pad_to(x: np.ndarray, crop: int) -> np.ndarray:
    h, w = x.shape[:2]
    ph, pw = max(crop - h, 0), max(crop - w, 0)
    return np.pad(x, ((ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))

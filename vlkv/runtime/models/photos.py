"""Real photographs for demos and tests, from the images bundled in the scikit-image wheel.

They are read from the installed package (no download), so they work offline. With
``smollm2-llava`` they give the vision tower real image statistics, unlike seeded noise.
"""

from __future__ import annotations

import importlib.util

from PIL import Image

# name -> (height, width) as shipped, all RGB uint8.
PHOTOS = {
    "chelsea": (300, 451),
    "astronaut": (512, 512),
    "coffee": (400, 600),
    "rocket": (427, 640),
}


def real_photos(
    names: tuple[str, ...] | list[str] = ("chelsea", "astronaut", "coffee", "rocket"),
) -> list[Image.Image]:
    """The named scikit-image sample photos as RGB PIL images, in the order asked.

    Raises:
        ValueError: an unknown name (the message lists the known ones), or scikit-image missing.
    """
    unknown = [name for name in names if name not in PHOTOS]
    if unknown:
        raise ValueError(f"unknown photo {unknown[0]!r}; known: {', '.join(PHOTOS)}")
    if importlib.util.find_spec("skimage") is None:
        raise ValueError(
            "real photos need the demo packages: bash scripts/install_demo.sh (missing: scikit-image)"
        )
    import skimage.data

    return [Image.fromarray(getattr(skimage.data, name)()).convert("RGB") for name in names]

"""Stands in for scikit-image on the GPU machine, where it cannot be installed (it needs
SciPy, too large to carry with the check): serves only ``skimage.data``'s sample photographs,
the files scikit-image ships (``scripts/gpu_wheelhouse.sh`` copies them from its wheel into
the wheelhouse's ``photos/``). ``scripts/gpu_check.sh`` puts this folder on ``PYTHONPATH``
only when ``import skimage.data`` fails there. Nothing else of scikit-image is here."""

"""Package discovery for the wheel and the editable install: nothing is listed by hand.

Every package under ``lppo/`` is found; ``lppo.callbacks`` is built from ``callbacks/`` (the
design card's top-level folder). ``pyproject.toml`` holds everything else.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["lppo", "lppo.*"]), "lppo.callbacks"],
    package_dir={"lppo.callbacks": "callbacks"},
)

"""Hydra search-path plugin: makes the configs of fp8_lightning visible to *any* Hydra application.

Hydra imports every module under the ``hydra_plugins`` namespace package at start-up and asks each
``SearchPathPlugin`` to extend the config search path. This one appends ``pkg://fp8_lightning.conf``, so a
user's own app can write, in its primary config::

    defaults:
      - precision: fp8_hybrid        # from this package
      - _self_

and override ``precision.recipe.margin=1`` on its command line, without copying YAML files. Appending (not
prepending) lets the user's own ``precision/`` options win over ours when the names clash.
"""

import os

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

PROVIDER = "fp8-lightning"
CONFIG_PACKAGE = "pkg://fp8_lightning.conf"
PID_RESOLVER = "fp8.pid"


def register_resolvers() -> None:
    """``${fp8.pid:}``: this process's id, which ``conf/hydra/default.yaml`` puts in every run folder's name (with
    the time to the microsecond), so that two runs started in the same second never share a folder. Registered
    when Hydra imports this module at start-up (any Hydra app, the compose API included) and by ``fp8-train``."""
    if not OmegaConf.has_resolver(PID_RESOLVER):
        OmegaConf.register_new_resolver(PID_RESOLVER, lambda: os.getpid())


register_resolvers()


class FP8LightningSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider=PROVIDER, path=CONFIG_PACKAGE)

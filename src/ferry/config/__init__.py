"""A run's configuration, the floor `ferry.train`, `ferry.plan` and `ferry.run` stand on: the root
config `FerryConfig` and `load_config` (`root`), the `train` and `offload` groups (`train`), the
`plan` group (`plan`), the command line's overrides composed by Hydra (`overrides`) and the
config's paths checked (`paths`). The `data`, `mesh`, `platform` and `distributed` groups are
defined beside their code (`ferry.data.config`, `ferry.sharding`, `ferry.platform`,
`ferry.distributed`), which stands below this floor."""

from ferry.config.root import FerryConfig, load_config

__all__ = ["FerryConfig", "load_config"]

"""Run configuration: typed dataclasses per component, YAML loading, key=value overrides."""

from __future__ import annotations

from rootopt.config.load import (
    OPTIMIZERS,
    ConfigError,
    apply_overrides,
    config_warnings,
    dump_yaml,
    from_dict,
    load_config,
    loss_scale_value,
    to_dict,
)
from rootopt.config.schema import (
    CheckpointConfig,
    ClipConfig,
    Config,
    DataConfig,
    DistributedConfig,
    MixedPrecisionConfig,
    ModelConfig,
    MonitoringConfig,
    OptimizationConfig,
    PrometheusConfig,
    RunConfig,
)

__all__ = [
    "OPTIMIZERS",
    "CheckpointConfig",
    "ClipConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "MixedPrecisionConfig",
    "ModelConfig",
    "MonitoringConfig",
    "OptimizationConfig",
    "PrometheusConfig",
    "RunConfig",
    "apply_overrides",
    "config_warnings",
    "dump_yaml",
    "from_dict",
    "load_config",
    "loss_scale_value",
    "to_dict",
]

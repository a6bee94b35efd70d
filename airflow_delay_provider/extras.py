"""Optional features and the extra that installs each, for the Airflow side: importing an SQS or Spark operator,
hook or trigger without its extra fails with the pip line that brings it.

The error is Airflow's AirflowOptionalProviderFeatureException, as Airflow's own providers raise for features of
another provider (Airflow's providers manager then logs a feature turned off, not a broken provider), and our
MissingExtraError, an ImportError."""

from __future__ import annotations

import importlib.util

from airflow.exceptions import AirflowOptionalProviderFeatureException

from airflow_delay_provider.core.errors import EXTRAS, MissingExtraError, extra_message

__all__ = ["EXTRAS", "OptionalFeatureError", "check_extra", "optional_feature_error"]

#: Modules each extra installs; the first one missing is named in the error.
_MODULES = {
    "amazon": ("airflow.providers.amazon", "boto3", "botocore"),
    "spark": ("airflow.providers.apache.spark", "pyspark"),
    "messaging": ("airflow.providers.common.messaging",),
}


class OptionalFeatureError(AirflowOptionalProviderFeatureException, MissingExtraError):
    """A feature of an extra that is not installed (see EXTRAS)."""


def optional_feature_error(extra: str, cause: ImportError) -> OptionalFeatureError:
    return OptionalFeatureError(extra_message(extra, cause), name=cause.name)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package that is missing or fails to import
        return False


def check_extra(extra: str) -> None:
    """Raise OptionalFeatureError unless the modules of `extra` can be found, without importing them (for modules
    whose import must stay cheap, as a trigger's in the triggerer)."""
    for module in _MODULES[extra]:
        if not _installed(module):
            raise optional_feature_error(extra, ModuleNotFoundError(f"No module named {module!r}", name=module))

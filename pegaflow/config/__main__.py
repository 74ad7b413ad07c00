"""``python -m pegaflow.config``: print the configuration reference (docs/configuration.md)."""

import sys

from .flags import reference_markdown

sys.stdout.write(reference_markdown())

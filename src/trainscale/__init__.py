"""trainscale: plan and run large-language-model training."""

__version__ = "0.1.0"

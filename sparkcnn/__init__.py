"""sparkcnn: data-parallel CNN training on Spark with sparse communication."""

__version__ = "0.1.0"

"""TinyLoop: inference engine and server for weight-shared looped transformer language models."""

__version__ = "0.1.0"

"""The `.tinyloop` model file format, in one folder:

    header.py   the header: its fields, reading it without torch (what `tinyloop list` / `info` and the command
                line's checks need before anything heavy is imported), resolving a model name to a file
    layout.py   the run-time tensor layout (q/k/v and gate/up fused, format version 2) and the older one
    loader.py   the tensors: what a config's file holds, reading, checking and loading a model; `write_model`
    writer.py   `ModelFileWriter`: a file written tensor by tensor at its place (converters, quantization)

This package's `__init__` imports nothing, so `modelfile.header` stays torch-free.
"""

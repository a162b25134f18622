"""The native decode executor: C++ kernels (`csrc/`) built for this CPU (`build.py`), their ctypes interface
and the executor's choice (`lib.py`), and the executor itself (`executor.py`). docs/decode.md has the map."""

"""TinyLoop's model store: models pulled from the Hugging Face Hub and converted (`tinyloop pull`).

`refs` names them (`hf:ORG/NAME[@REVISION][:int4]`) and finds their files under `$TINYLOOP_HOME`
(torch-free); `catalog` lists and removes them (torch-free); `pull` downloads and converts.
"""

from ..modelfile.header import set_hub_resolver


def _resolve(name: str):
    from .pull import resolve_pulled  # (huggingface_hub and torch only when it must pull)

    return resolve_pulled(name)


set_hub_resolver(_resolve)  # wherever a model path goes, an hf: name now resolves (and pulls on first use)

"""TinyLoop's model store: models pulled from the Hugging Face Hub and converted (`tinyloop pull`).

`refs` names them (`hf:ORG/NAME[@REVISION][:int4]`) and finds their files under `$TINYLOOP_HOME`
(torch-free); `catalog` lists and removes them (torch-free); `pull` downloads and converts.
"""

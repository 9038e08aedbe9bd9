"""HF <-> Megatron torch_dist checkpoint conversion, with the model-identity gate in front.

| module      | holds                                                           |
|-------------|-----------------------------------------------------------------|
| convert.py  | convert (HF -> torch_dist) and export_hf (torch_dist -> HF)     |
| __main__.py | `python -m infra.convert HF_DIR --out DIR` (and `--to-hf` back) |

The models, the HF name mappings, the checkpoint layout and the identity gate are the learner's own
(trainer/models/); this package only writes and reads checkpoint files with them.
Importing this package does not import torch or megatron-core.
"""

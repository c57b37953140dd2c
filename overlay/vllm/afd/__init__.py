# SPDX-License-Identifier: Apache-2.0
"""Attention-FFN Disaggregation (AFD) for vLLM.

Modules: ``model_split`` (which part of the model each role builds),
``attention`` (the attention role's remote-FFN op and connection),
``ffn_runner`` (the FFN role's model runner and serve loop), ``engine``
(the FFN role in EngineCore), ``protocol`` (wire format). Connectors live in
``vllm.distributed.afd``; the configuration in ``vllm.config.afd``.
"""

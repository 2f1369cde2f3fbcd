"""The demo program (`python -m mindspeed_te.demo`): a megatron-core GPT trained in bf16 and in every FP8/HiF8
recipe on the same data. `train` runs and reports, `corpus` supplies the bytes, `plots` draws the figures."""

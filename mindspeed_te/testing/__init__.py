"""Test doubles shipped with the library (the torch_npu simulator); never imported by the library's own code
except where a user asks for the simulator (MINDSPEED_TE_NPU_SIMULATOR=1)."""

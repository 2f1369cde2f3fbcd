"""`python -m mindspeed_te.demo`: see mindspeed_te.demo.train."""
from mindspeed_te.demo.train import main

main()

"""`python -m nvgroup_tf.runner -np 2 python train.py` == `nvgrouprun -np 2 python train.py`."""
from nvgroup_tf.runner.launch import main

main()

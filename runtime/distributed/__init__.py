"""Several GPUs of one host: the processes of a tensor-parallel plan (launch.py: one per GPU, started here or by
torchrun, torch.distributed initialized in each) and the collectives that join their shares of the model
(collectives.py). Takes a plan's `parallel:` section; gives each process its rank and the hooks that sum or
gather its modules' outputs. Imports nothing else of the runtime: place/ cuts each process's share with it."""

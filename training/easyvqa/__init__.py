"""Training of vlmrt's easy-VQA demo model, one module per job; the command is training/train_easyvqa.py.

    prepare.py   seeds, the easy-VQA splits and images, the base checkpoint, the concept prompts (every phase)
    data.py      images as the bundle normalizes them, the token batches, the concept prompts
    lora.py      the LoRA wrapper on the decoder's linears
    schedule.py  the learning-rate schedule
    score.py     teacher-forced exact match
    phase_a.py   decoder side: LoRA on the last layers, concept prompts in the image slots
    phase_b.py   vision side: tower + probe, ridge connector, tower + connector, ridge again
    join.py      loads both halves, scores the whole model, writes weights.safetensors and training.json
    plot.py      the training curve
"""

"""A small ResNet at several image sizes: the harness's loss-driven step, checkpointing per block.

    python -m harness sweep workload=custom workload.target=examples.resnet:build \
        batch_size=32,64 +workload.args.image_size=64,128,224 checkpointing=false,true
"""

import torch
import torch.nn.functional as F
from torch import nn

from harness.workload import Job, Knobs


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet(nn.Module):
    def __init__(self, widths=(32, 64, 128, 256), classes: int = 100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            layers += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build(k: Knobs) -> Job:
    size = int(k.args.get("image_size", 64))
    model = ResNet().to(k.dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images = torch.randn(k.batch_size, 3, size, size, dtype=k.dtype)
    labels = torch.randint(0, 100, (k.batch_size,))
    return Job(model, optimizer, (images, labels), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
               blocks=BasicBlock, name=f"resnet-{size}px")

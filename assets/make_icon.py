"""Draws Quince's icon (a golden quince on a soft green tile) at 1024 px: assets/icon.png.
The sizes Tauri bundles are made from it by `npx tauri icon assets/icon.png -o src-tauri/icons`."""
from PIL import Image, ImageDraw, ImageFilter

S = 1024
img = Image.new("RGBA", (S, S), (0, 0, 0, 0))
d = ImageDraw.Draw(img)
d.rounded_rectangle([40, 40, S - 40, S - 40], radius=220, fill=(38, 70, 58, 255))
# The fruit: two overlapping ellipses, a pear-ish quince.
fruit = Image.new("RGBA", (S, S), (0, 0, 0, 0))
f = ImageDraw.Draw(fruit)
gold = (244, 196, 48, 255)
f.ellipse([230, 330, 794, 880], fill=gold)
f.ellipse([340, 220, 684, 600], fill=gold)
shade = Image.new("RGBA", (S, S), (0, 0, 0, 0))
ImageDraw.Draw(shade).ellipse([300, 380, 560, 640], fill=(255, 240, 190, 120))
fruit = Image.alpha_composite(fruit, shade.filter(ImageFilter.GaussianBlur(40)))
img = Image.alpha_composite(img, fruit)
d = ImageDraw.Draw(img)
d.line([512, 240, 540, 150], fill=(92, 60, 30, 255), width=26)
d.ellipse([540, 120, 720, 210], fill=(120, 180, 90, 255))
img.save("assets/icon.png")

# proto/embed.cmake — writes OUT, a C file defining the bytes of IN (the descriptor set) as
# pie_proto_descriptor_set / pie_proto_descriptor_set_len (declared in proto/pie_desc.h).
# Usage: cmake -DIN=pie.desc -DOUT=pie_desc.c -P embed.cmake
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" n)
math(EXPR bytes "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
file(WRITE ${OUT} "/* Generated from pie.desc by proto/embed.cmake: do not edit. */\n"
                  "#include \"pie_desc.h\"\n\n"
                  "const unsigned char pie_proto_descriptor_set[] = {\n    ${body}\n};\n"
                  "const size_t pie_proto_descriptor_set_len = ${bytes};\n")

# agentenv Firecracker test guest (see testguest.py): counts forever, prints n=<count> to the UART.
    .code64
    .section .text
    .globl _start
_start:
    lea stack_top(%rip), %rsp
    lea banner(%rip), %rsi
    call puts
1:  incq counter(%rip)
    mov counter(%rip), %rax
    call putnum
    mov delay(%rip), %rcx
2:  dec %rcx
    jnz 2b
    jmp 1b
puts:                       # rsi = NUL-terminated string
    mov $0x3f8, %dx
3:  lodsb
    test %al, %al
    jz 4f
    outb %al, %dx
    jmp 3b
4:  ret
putnum:                     # "n=<rax decimal>\n"
    lea numbuf_end(%rip), %rdi
    movb $0, (%rdi)
    dec %rdi
    movb $10, (%rdi)
    mov $10, %rbx
5:  xor %rdx, %rdx
    div %rbx
    add $'0', %dl
    dec %rdi
    mov %dl, (%rdi)
    test %rax, %rax
    jnz 5b
    dec %rdi
    movb $'=', (%rdi)
    dec %rdi
    movb $'n', (%rdi)
    mov %rdi, %rsi
    jmp puts
    .section .data
banner: .asciz "agentenv-test-guest up\n"
    .balign 8
    .globl counter
counter: .quad 0
delay: .quad 20000
numbuf: .space 32
numbuf_end: .byte 0
    .section .bss
    .balign 16
    .space 4096
stack_top:
